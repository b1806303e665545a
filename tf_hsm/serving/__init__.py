from tf_hsm.serving.hsm import log_prob, log_prob_all, sample, top_k
