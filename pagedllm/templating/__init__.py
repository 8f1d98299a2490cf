"""Chat templates: rendered as transformers renders them (render.py), in worker processes under time, memory and
output limits (sandbox.py, worker.py). Below model/: the tokenizer renders with it."""
