"""Experiment tracking from rank 0: TensorBoard, MLflow and W&B (offline) through their own libraries."""
