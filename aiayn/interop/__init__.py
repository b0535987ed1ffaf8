"""Moving models between aiayn and the ecosystem: Hugging Face formats and ONNX."""
