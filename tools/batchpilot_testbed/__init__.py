"""What the e2e suite and the cluster benchmarks share: real Triton Pods on the local cluster
(`fleet`), clients through Services (`clients`, `balancing`), faults (`faults`), the operator as
its own process (`operators`), the chart on a real API server (`charts`), namespaces, waiting."""
