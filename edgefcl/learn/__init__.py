"""Learning: models, perturbations, uncertainty scores, replay memory, the online Client."""
