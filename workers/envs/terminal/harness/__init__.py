"""Source shipped into sandbox sessions (never imported by the host)."""
