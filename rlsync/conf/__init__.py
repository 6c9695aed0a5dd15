"""rlsync's Hydra configs (YAML), shipped inside the package: every entry point reads them as
`pkg://rlsync.conf`, so an installed rlsync needs no checkout. The top-level `conf` is a link here."""
