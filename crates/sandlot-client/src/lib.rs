//! Rust client of the Sandlot HTTP API v1 (placeholder).
