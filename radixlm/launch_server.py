"""`python -m radixlm.launch_server [--model-path ...] [--port 30000] ...`"""

from radixlm.srt.entrypoints.launch import main

if __name__ == "__main__":
    main()
