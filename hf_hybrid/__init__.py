"""hf_hybrid: hybrid predictive training for the Hugging Face Trainer."""
