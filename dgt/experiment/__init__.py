"""The main job: reproduce the DGT paper's Table 1 in emulation (``dgt experiment table1``, ``dgt demo``).

Trains the same model with K workers twice under the same emulated network, once with every gradient on the reliable
lane (the paper's baseline) and once with DGT, and reports batch completion time and time to a target accuracy.
"""
