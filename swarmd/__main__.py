from swarmd.node.cli import main

main()
