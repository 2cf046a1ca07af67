// Command stor-ctl operates a stor cluster from an operator's shell: cluster
// status, servers, volumes and snapshots, over the cluster's control API.
//
//	stor-ctl --server 10.0.0.1:7400,10.0.0.2:7400 cluster status
//	stor-ctl volume create db --size 10GiB --replicas 3
//	stor-ctl volume list -o json
//
// The servers come from --server or $STOR_SERVER (default 127.0.0.1:7400).
// Run "stor-ctl --help" for the commands; the command tree lives in
// internal/ctl.
package main

import (
	"os"

	"github.com/stor-io/stor/internal/ctl"
)

func main() {
	os.Exit(ctl.Execute(os.Args[1:], os.Stdout, os.Stderr))
}
