from sidecar.cli import main

main(prog_name="sluice")
