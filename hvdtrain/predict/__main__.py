from hvdtrain.predict import main

main()
