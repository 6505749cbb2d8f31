"""The BatchPolicy API, as one unit: its names (`names`), its versions (`v1alpha1`: the typed
spec and status), the cross-field rules that are both Python checks and CEL (`validations`), the
wire formats it shares (`durations`, `calendar_names`), reading policies as users write them
(`documents`) and the CustomResourceDefinition generated from all of it (`crds`).

A second version sits beside `v1alpha1` as its own package; `crds` serves each and stores one.
Nothing here performs I/O; the policy core (`batchpilot.policy`) decides on these types.
"""
