"""draftline: train, gate and serve EAGLE-3 drafters on Ray, MLflow and SGLang."""

__version__ = "0.1.0"
