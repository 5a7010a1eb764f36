"""Memory: what training keeps and where model state lives.

``saved_activations`` measures the bytes autograd keeps for backward (the planner's and the
tuner's activation figures); ``offload`` is the seam where chunks of parameters, gradients and
optimizer states are placed on device, host or disk (the last applier of ``parallelize``)."""
