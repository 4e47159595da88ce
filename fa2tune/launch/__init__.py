"""Launching rendered kernels: grids, launch plans, the warp-specialized launches, the direct launch path, the
persistent schedules and the autograd wiring. Takes a resolved config; never reads a config file.

launcher is the layer's interface for the layers above; its docstring maps the modules behind it."""
