"""Pure tensor functions: no I/O, no config objects, no globals.

Shapes: ``B`` trajectories, ``G`` group size, ``L`` tokens, ``S`` segments, ``T`` steps/turns.
"""
