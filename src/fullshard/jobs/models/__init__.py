"""Models of the training jobs: the GPT of ``train gpt`` and the FSDP tutorial's MNIST Net."""
