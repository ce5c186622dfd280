#!/bin/bash
echo x > out.txt
