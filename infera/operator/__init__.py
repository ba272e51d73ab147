"""The Kubernetes operator: the InferaDeployment CRD (crd.py), its spec model (spec.py), the
renderer (render.py) and the controller (controller.py). docs/kubernetes.md is the contract."""
