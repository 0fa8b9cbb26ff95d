"""Using a trained model: find it from a path, decode with a KV cache, sample and chat, export
and import (safetensors, Hugging Face GPT-2 layout)."""
