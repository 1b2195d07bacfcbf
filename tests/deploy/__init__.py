"""The images, compose files and Kubernetes manifests: validated, built and run."""
