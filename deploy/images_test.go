package deploy

import (
	"context"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// imageBinDir is where make image-binaries writes the static binaries the
// Dockerfiles copy (the Makefile's IMAGE_BIN).
const imageBinDir = "bin/image/"

var (
	copyLine = regexp.MustCompile(`(?m)^COPY\s+(.+)$`)
	aptLine  = regexp.MustCompile(`(?s)apt-get install[^&]*`)
)

// TestDockerfilesCopyWhatTheBuildMakes checks each Dockerfile against what
// exists: every binary it copies is a command under cmd/ (which make
// image-binaries builds into bin/image/), every other file it copies is in
// the repository, the node image has the filesystem tools, and the
// manifests run each image's binaries at the paths it installs them.
func TestDockerfilesCopyWhatTheBuildMakes(t *testing.T) {
	mk, err := os.ReadFile("../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(mk), "IMAGE_BIN ?= $(BIN)/image") || !strings.Contains(string(mk), "-o $(IMAGE_BIN)/ ./cmd/...") {
		t.Fatalf("the Makefile's image-binaries no longer builds ./cmd/... into bin/image: update this test")
	}
	installed := map[string][]string{} // image -> files under /usr/local/bin
	for _, image := range []string{"stor-server", "stor-csi"} {
		t.Run(image, func(t *testing.T) {
			df, err := os.ReadFile(filepath.Join("images", image, "Dockerfile"))
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range copyLine.FindAllStringSubmatch(string(df), -1) {
				fields := strings.Fields(m[1])
				dest := fields[len(fields)-1]
				for _, src := range fields[:len(fields)-1] {
					name := path.Base(src)
					if strings.HasSuffix(dest, "/") {
						installed[image] = append(installed[image], path.Join(dest, name))
					} else {
						installed[image] = append(installed[image], dest)
					}
					if bin, ok := strings.CutPrefix(src, imageBinDir); ok {
						if _, err := os.Stat(filepath.Join("..", "cmd", bin)); err != nil {
							t.Errorf("COPY %s: no cmd/%s, so make image-binaries does not build it", src, bin)
						}
						continue
					}
					if _, err := os.Stat(filepath.Join("..", src)); err != nil {
						t.Errorf("COPY %s: %v", src, err)
					}
				}
			}
			if image == "stor-csi" {
				pkgs := strings.Fields(aptLine.FindString(string(df)))
				for _, want := range []string{"e2fsprogs", "xfsprogs", "util-linux", "kmod", "curl", "jq"} {
					if !slices.Contains(pkgs, want) {
						t.Errorf("the node image does not install %s (apt-get line %q)", want, pkgs)
					}
				}
			}
		})
	}

	// Every absolute binary path the manifests run from a stor image is one
	// the image installs.
	objs, errs := validate(filesys.MakeFsOnDisk(), "kubernetes/base", binaryFlags(t))
	reportAll(t, errs)
	for _, p := range podTemplates(objs) {
		for _, c := range allContainers(p.spec) {
			image := path.Base(strings.SplitN(c.Image, ":", 2)[0])
			files, ok := installed[image]
			if !ok {
				continue
			}
			for _, a := range strings.Fields(strings.Join(commandLine(c), " ")) {
				if strings.HasPrefix(a, "/usr/local/bin/") && !slices.Contains(files, a) {
					t.Errorf("%s: container %s runs %s, which image %s does not install (%v)", p.owner, c.Name, a, image, files)
				}
			}
		}
	}
}

// TestNodeZoneScript runs images/node-zone against a fake API server over
// TLS, as the init containers run it in a pod.
func TestNodeZoneScript(t *testing.T) {
	for _, tool := range []string{"sh", "curl", "jq"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("node-zone needs %s: %v", tool, err)
		}
	}
	nodes := map[string]string{
		"/api/v1/nodes/zoned":   `{"kind":"Node","metadata":{"name":"zoned","labels":{"kubernetes.io/hostname":"zoned","topology.kubernetes.io/zone":"eu-west-1b"}}}`,
		"/api/v1/nodes/unzoned": `{"kind":"Node","metadata":{"name":"unzoned","labels":{"kubernetes.io/hostname":"unzoned"}}}`,
	}
	api := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer test-token" {
			http.Error(w, `{"kind":"Status","code":401}`, http.StatusUnauthorized)
			return
		}
		body, ok := nodes[r.URL.Path]
		if !ok || r.Method != http.MethodGet {
			http.Error(w, `{"kind":"Status","code":404}`, http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(api.Close)
	host, port, err := net.SplitHostPort(api.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	sa := t.TempDir()
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: api.Certificate().Raw})
	if err := os.WriteFile(filepath.Join(sa, "ca.crt"), caPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	writeToken := func(tok string) {
		if err := os.WriteFile(filepath.Join(sa, "token"), []byte(tok), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	run := func(node string) (zone string, err error) {
		out := filepath.Join(t.TempDir(), "zone")
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "images/node-zone", out)
		cmd.Env = append(os.Environ(), "NODE_NAME="+node, "SERVICEACCOUNT_DIR="+sa,
			"KUBERNETES_SERVICE_HOST="+host, "KUBERNETES_SERVICE_PORT="+port)
		msg, err := cmd.CombinedOutput()
		t.Logf("node-zone %s: %s", node, strings.TrimSpace(string(msg)))
		if err != nil {
			return "", err
		}
		b, err := os.ReadFile(out)
		return string(b), err
	}

	writeToken("test-token")
	if zone, err := run("zoned"); err != nil || zone != "eu-west-1b" {
		t.Errorf("zoned node: zone %q, err %v; want eu-west-1b", zone, err)
	}
	if zone, err := run("unzoned"); err != nil || zone != "" {
		t.Errorf("node without a zone label: zone %q, err %v; want an empty file", zone, err)
	}
	// A failed lookup fails the init container (and so the pod start)
	// rather than starting a server with no zone.
	if zone, err := run("missing"); err == nil {
		t.Errorf("unknown node: zone %q and no error, want a failure", zone)
	}
	writeToken("wrong-token")
	if zone, err := run("zoned"); err == nil {
		t.Errorf("rejected token: zone %q and no error, want a failure", zone)
	}
}

// TestImagesAreBuiltByADocumentedCommand: the placeholders the manifests
// use are what make images tags, and docs/INSTALL.md documents the
// command and the kustomization lines a user changes.
func TestImagesAreBuiltByADocumentedCommand(t *testing.T) {
	mk, err := os.ReadFile("../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../docs/INSTALL.md")
	if err != nil {
		t.Fatal(err)
	}
	kust, err := os.ReadFile("kubernetes/base/kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(mk), "IMAGE_TAG ?= "+placeholderTag+"\n") || !regexp.MustCompile(`(?m)^images: image-binaries$`).Match(mk) {
		t.Errorf("the Makefile has no images target tagging %s by default", placeholderTag)
	}
	for _, img := range storImages {
		build := fmt.Sprintf("-f deploy/images/%s/Dockerfile -t $(IMAGE_REPO)%s:$(IMAGE_TAG) .", img, img)
		if !strings.Contains(string(mk), build) {
			t.Errorf("make images does not build %s as %q", img, build)
		}
		entry := fmt.Sprintf("  - name: %s\n    newName: %s\n    newTag: %s\n", img, img, placeholderTag)
		if !strings.Contains(string(kust), entry) {
			t.Errorf("the base kustomization's images: has no placeholder entry %q", entry)
		}
		if !strings.Contains(string(doc), "newName: "+img) {
			t.Errorf("docs/INSTALL.md does not show the newName line of %s", img)
		}
	}
	if !strings.Contains(string(doc), "make images") {
		t.Error("docs/INSTALL.md does not document make images")
	}
}
