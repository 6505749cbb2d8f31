# The sample model repository as an image of files alone, for a Pod's image volume
# (Kubernetes 1.35+, on by default; containerd 2.1+ or CRI-O 1.31+): every replica on every node
# reads the same repository, pulled like any image, with no shared volume to provision. Triton
# mounts it read-only at /models (manifests/triton-deployment.yaml says how); batchpilot's loads
# send the configuration in the request and never write to the repository. Build yours the same
# way from your own repository's folder:
#   docker build -f manifests/model-repository.Dockerfile -t registry.example.com/models:1 .
FROM scratch
COPY manifests/model-repository /
