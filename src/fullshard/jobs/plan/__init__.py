"""Memory and step-time prediction for FSDP configurations (issue 17): the live-tensor tracker
that measures, and the estimator that predicts without allocating."""
