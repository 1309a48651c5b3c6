"""Global Hessians: Kronecker factors of the end-to-end loss (SPEC §6)."""
