#!/bin/bash
sed -i 's/rows\[1:\]/rows/' /app/src/total.py
