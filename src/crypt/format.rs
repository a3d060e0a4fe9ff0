//! New LUKS headers (`vublk create --encrypt luks1|luks2`).
