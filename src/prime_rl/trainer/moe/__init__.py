"""Mixture-of-experts models in the trainer: finding their routers, and router replay."""
