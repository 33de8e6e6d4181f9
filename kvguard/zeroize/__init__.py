"""Physical cleanup of KV blocks.

Owns: cache layout descriptions, planning which bytes to clear, executors (one-launch Triton kernel on
GPU, torch on CPU), verification read-back and evidence records. Never decides *whether* a block is
zeroized: the custody core asks policy and hands this package a plan. Importing it needs neither Triton
nor a GPU.
"""
