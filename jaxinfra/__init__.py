"""jaxinfra: a JAX/Flax-NNX LLM training stack."""
