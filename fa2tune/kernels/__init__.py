"""Kernel source: renders templates/ into Triton and Gluon modules (codegen), compiles them offline to check a
config against the compiler (probe), and the Gluon extension the backward kernels use (gluon_ext)."""
