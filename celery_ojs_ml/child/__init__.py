"""The pool child: device pinning around a task body, GPU-share env and the model cache."""
