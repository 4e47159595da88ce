"""Kernel source: renders templates/ into Triton and Gluon modules (codegen) and the Gluon extension the backward
kernels use (gluon_ext)."""
