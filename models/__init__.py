"""Model loading: names of the embedded models, GGUF reading, the GGUF tokenizer, shapes.

`models.loading.load_model` is the one entry point; `models.shape.kv_shape` is what the
caches and the budget need to know of a loaded model. Nothing here knows of caches.
"""
