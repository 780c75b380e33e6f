"""Triton kernels of the engine (CUDA only; each has a plain-torch reference for CPU and tests).

    paged_attention.py  decode attention that reads the paged KV pool in place
"""
