from hvdtrain.bench import main

main()
