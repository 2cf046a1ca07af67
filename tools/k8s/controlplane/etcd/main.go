// Command etcd is etcd's own server (go.etcd.io/etcd/server/v3's
// etcdmain), at the version k8s.io/kubernetes itself requires.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
