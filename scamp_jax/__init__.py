"""scamp-jax: memory-aware parallel deep-learning search in JAX."""
