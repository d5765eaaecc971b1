"""Training loops (RL and pretraining), distributed glue, checkpoints, logging.

Nothing else in ddrl imports this package: dependencies point one way.
"""
