//! Nothing of its own: the tests build the crate with serde_json's `arbitrary_precision`.
