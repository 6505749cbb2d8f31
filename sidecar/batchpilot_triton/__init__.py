"""What batchpilot's two programs share: how to read a Triton server and the sidecar beside it.

The operator (with the standalone runner) and the sidecar are separate programs that must not
import each other: the sidecar image carries neither kopf nor the Kubernetes client. What both
need sits here, below them both:

- `endpoints`: the ports Triton and the sidecar listen on, and `HOST:PORT` parsing;
- `servers`: an asynchronous client for one Triton server (repository API, configs, statistics,
  metrics page);
- `scraping`: Triton's metrics page, parsed series by series, and per-model rates;
- `modelconfigs`: what batchpilot reads in a served model configuration;
- `reports`: the sidecar's `/status` document, one typed model that the sidecar writes and the
  operator reads, and the query that asks it for recommendations;
- `exposition`: serving a Prometheus registry on `/metrics`;
- `repositories`: an LLM model's engine arguments (`model.json`) in a model repository, which
  the runner reads itself and the operator asks the sidecar for.

Nothing here knows policies, Kubernetes or the GPU.
"""

__version__ = "0.1.0"
"""The version of every batchpilot distribution (both pyproject files read it from here)."""
