"""The cluster simulator: step costs from compiled programs and a discrete-event driver
of the scheduling core (`scamp_jax.scheduling`).
"""
