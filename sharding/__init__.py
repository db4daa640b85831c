"""Meshes, logical-axis rules and the activation-sharding context."""
