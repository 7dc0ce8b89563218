from benchmarks import main

main()
