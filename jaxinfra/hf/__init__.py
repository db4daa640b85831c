"""Hugging Face interop: import HF safetensors checkpoints as jaxinfra runs, export runs back.

families.py         config.json <-> ModelConfig, per family (refuses what we do not model)
tensors.py          per-parameter tensor names and layout conversions (incl. DeepSeek's rope order)
safetensors_io.py   one-tensor-at-a-time reading and streaming writing of safetensors
importer.py         HF dir -> OUT/config.yaml + OUT/checkpoints/0 (params only), sharded by streaming
exporter.py         run dir or checkpoint -> config.json + model*.safetensors (+ index)
cli.py              `jaxinfra hf import|export`
"""
