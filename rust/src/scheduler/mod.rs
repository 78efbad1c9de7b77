//! Continuous-batching scheduler (in progress).
