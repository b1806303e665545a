"""`python -m tf_hsm.demo`: output layers compared on a word-level language model.
run.py holds it all: the corpora, the trees, the models, the training and the report."""
