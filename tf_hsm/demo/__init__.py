"""`python -m tf_hsm.demo`: output layers compared on a word-level language model.
run.py holds the corpora, the trees, the models, the training and the report;
optimizer.py the LazyAdam whose output layer trains at a multiple of the rate
(`--output-lr-scale`); bands.py the held-out loss by word frequency (`--bands`,
`python -m tf_hsm.demo.bands`)."""
