"""Triton kernels of the engine (CUDA only; the tests hold a plain-torch reference of each, and on CPU
the engine keeps its plain torch path).

    paged_attention.py  decode attention that reads the paged KV pool in place
"""
