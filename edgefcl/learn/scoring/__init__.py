"""Uncertainty scoring of the client's candidates: the score functions (`scores`), the
test-time views (`perturb`, with the batched geometric warps of `warp`), the scoring process
(`worker`) and the onnxruntime scoring snapshot (`snapshot`). The learner's posterior samples
come from `edgefcl.learn.bayes` (also used for training and prediction), the protocols the
collaborators see the learner through from `edgefcl.learn.views`."""
