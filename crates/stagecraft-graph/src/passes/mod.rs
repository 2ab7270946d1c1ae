//! Optimization passes over functions.
