"""Inference tier of chatpipe: the engine (``inference.engine``, pure PyTorch, no Kafka) and, later,
the Kafka worker and the HTTP gateway around it."""
