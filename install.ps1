# unsloth installer for Windows (PowerShell 5.1 and 7).
#
#   irm <release>/install.ps1 | iex                 the released package (UNSLOTH_VERSION picks one)
#   powershell -File install.ps1 [-Yes] [-DryRun]   from a clone: installs that clone
#
# Like install.sh, this only finds a Python, gets uv and creates a small bootstrap environment
# holding this package; `unsloth install` makes every hardware decision and builds the managed
# environment transactionally. Options are parameters or UNSLOTH_* variables (docs/install.md).
# Everything is inside functions and the last line calls one: a partial download runs nothing.

$UnslothUvVersion = '0.13.9'
$UnslothPythonMin = [version]'3.10'
$UnslothPythonMax = [version]'3.13'
$UnslothPythonDefault = '3.12'

function Write-Step {
    param([string]$Message)
    Write-Host "==> $Message"
}

function Stop-Install {
    param([string]$Message)
    Write-Host "error: $Message" -ForegroundColor Red
    throw "unsloth install stopped: $Message"
}

function Get-UnslothHome {
    if ($env:UNSLOTH_HOME) { return $env:UNSLOTH_HOME }
    return (Join-Path $env:LOCALAPPDATA 'unsloth')
}

function Test-PythonVersion {
    param([string]$Python)
    try {
        $text = & $Python -c 'import sys; print(".".join(map(str, sys.version_info[:2])))' 2>$null
    } catch {
        return $false
    }
    if (-not $text) { return $false }
    $version = [version]$text.Trim()
    return ($version -ge $UnslothPythonMin -and $version -le $UnslothPythonMax)
}

# A Python 3.10 to 3.13: UNSLOTH_PYTHON, the py launcher, or python on PATH (not the Store stub).
function Find-Python {
    if ($env:UNSLOTH_PYTHON) {
        if (Test-PythonVersion $env:UNSLOTH_PYTHON) { return $env:UNSLOTH_PYTHON }
        Stop-Install "UNSLOTH_PYTHON=$($env:UNSLOTH_PYTHON) is not a Python $UnslothPythonMin to $UnslothPythonMax"
    }
    $launcher = Get-Command 'py' -ErrorAction SilentlyContinue
    if ($launcher) {
        foreach ($minor in @('3.12', '3.13', '3.11', '3.10')) {
            # PowerShell 5.1 turns a native command's stderr into an error under 'Stop': catch it.
            try { $path = & $launcher.Source "-$minor" -c 'import sys; print(sys.executable)' 2>$null } catch { $path = $null }
            if ($LASTEXITCODE -eq 0 -and $path) { return $path.Trim() }
        }
    }
    $candidates = @(Get-Command 'python' -All -ErrorAction SilentlyContinue)
    foreach ($candidate in $candidates) {
        if ($candidate.Source -like '*WindowsApps*') { continue }
        if (Test-PythonVersion $candidate.Source) { return $candidate.Source }
    }
    return $null
}

function Find-Uv {
    param([string]$Bootstrap)
    $candidates = @($env:UNSLOTH_UV, (Join-Path $Bootstrap 'Scripts\uv.exe'))
    $onPath = Get-Command 'uv' -ErrorAction SilentlyContinue
    if ($onPath) { $candidates += $onPath.Source }
    foreach ($candidate in $candidates) {
        if ($candidate -and (Test-Path $candidate)) { return $candidate }
    }
    return $null
}

# The standalone uv: its PyPI wheel, checked against the pinned sha256 before anything is unpacked.
# UNSLOTH_UV_DOWNLOAD_URL: a folder (mirror) holding the same wheel; UNSLOTH_UV_SHA256: another build's hash.
function Get-StandaloneUv {
    param([string]$UnslothHome)
    # uv's PyPI wheels for Windows: URL and sha256 as PyPI's index lists them, pinned beside the version
    # and never fetched from where uv comes from (install.sh pins the Linux and macOS wheels the same way).
    $pins = @{
        'x86_64-pc-windows-msvc'  = @('https://files.pythonhosted.org/packages/dd/ef/ceeabf3631117f7354787d9fb1ffe943899e59ed4b887a696ed547e47e76/uv-0.13.9-py3-none-win_amd64.whl', '6a44b2ed8111d2f60d2b92627c5dccda3f7ed7570b18ce115e569cd68c28246b')
        'aarch64-pc-windows-msvc' = @('https://files.pythonhosted.org/packages/da/d1/d97a5db1f27e077e4d6329223f6b3f719c02c97e4092043f13e628558d05/uv-0.13.9-py3-none-win_arm64.whl', 'eeb92051c2123b9730c46b04cc843cfa4bc7d7b0aec56df431a2215ef4cb0273')
    }
    $target = 'x86_64-pc-windows-msvc'
    if ($env:PROCESSOR_ARCHITECTURE -eq 'ARM64') { $target = 'aarch64-pc-windows-msvc' }
    $url = $pins[$target][0]
    $expected = $pins[$target][1]
    $wheel = $url.Substring($url.LastIndexOf('/') + 1)
    if ($env:UNSLOTH_UV_DOWNLOAD_URL) { $url = $env:UNSLOTH_UV_DOWNLOAD_URL.TrimEnd('/') + '/' + $wheel }
    if ($env:UNSLOTH_UV_SHA256) { $expected = $env:UNSLOTH_UV_SHA256 }
    $tmp = Join-Path ([System.IO.Path]::GetTempPath()) ("unsloth-uv-" + [guid]::NewGuid())
    New-Item -ItemType Directory -Path $tmp | Out-Null
    try {
        Write-Step "Downloading uv $UnslothUvVersion ($target)"
        $ProgressPreference = 'SilentlyContinue'  # the progress bar makes Invoke-WebRequest very slow on 5.1
        $zip = Join-Path $tmp 'uv.zip'  # a wheel is a zip; Expand-Archive on 5.1 wants the .zip name
        Invoke-WebRequest -UseBasicParsing -Uri $url -OutFile $zip
        $actual = (Get-FileHash -Algorithm SHA256 -Path $zip).Hash
        if ($actual -ne $expected.ToUpper()) {
            Stop-Install "the uv download from $url is corrupt or tampered with (sha256 $actual, expected $expected); nothing was installed. Run this again; behind a mirror that rebuilds wheels, set UNSLOTH_UV_SHA256 to its hash"
        }
        Expand-Archive -Path $zip -DestinationPath $tmp -Force
        $dest = Join-Path $UnslothHome 'uv'
        New-Item -ItemType Directory -Force -Path $dest | Out-Null
        Copy-Item -Path (Join-Path $tmp "uv-$UnslothUvVersion.data\scripts\uv.exe") -Destination $dest -Force
        return (Join-Path $dest 'uv.exe')
    } finally {
        Remove-Item -Recurse -Force -Path $tmp -ErrorAction SilentlyContinue
    }
}

# Where this package comes from: this clone, UNSLOTH_SOURCE, or the release archive.
function Get-PackageSource {
    param([string]$ScriptPath)
    if ($env:UNSLOTH_SOURCE) { return $env:UNSLOTH_SOURCE }
    if ($ScriptPath) {
        $here = Split-Path -Parent $ScriptPath
        $pyproject = Join-Path $here 'pyproject.toml'
        if ((Test-Path $pyproject) -and (Select-String -Path $pyproject -Pattern '^name = "unsloth-installer"' -Quiet)) {
            return $here
        }
    }
    $releases = $env:UNSLOTH_RELEASE_URL
    if (-not $releases) { $releases = 'https://github.com/unsloth-installer/unsloth/releases' }
    if ($env:UNSLOTH_VERSION -and $env:UNSLOTH_VERSION -ne 'latest') {
        return "$releases/download/v$($env:UNSLOTH_VERSION)/unsloth_installer-$($env:UNSLOTH_VERSION).tar.gz"
    }
    return "$releases/latest/download/unsloth_installer.tar.gz"
}

# UNSLOTH_* index overrides as flags that pip and uv both read.
function Get-IndexArguments {
    $arguments = @()
    if ($env:UNSLOTH_INDEX_URL) { $arguments += @('--index-url', $env:UNSLOTH_INDEX_URL) }
    foreach ($url in @("$($env:UNSLOTH_EXTRA_INDEX_URL)" -split '\s+')) {
        if ($url) { $arguments += @('--extra-index-url', $url) }
    }
    foreach ($link in @("$($env:UNSLOTH_FIND_LINKS)" -split '\s+')) {
        if ($link) { $arguments += @('--find-links', $link) }
    }
    return $arguments
}

# The bootstrap environment: uv and this package, enough to run `unsloth install`.
function Install-Bootstrap {
    param([string]$UnslothHome, [string]$Python, [string]$Source)
    $bootstrap = Join-Path $UnslothHome 'bootstrap'
    $bootPython = Join-Path $bootstrap 'Scripts\python.exe'
    $indexArguments = Get-IndexArguments
    if (-not (Test-Path $bootPython)) {
        if ($Python) {
            Write-Step "Creating the bootstrap environment with $Python"
            & $Python -m venv $bootstrap
        } else {
            $uv = Find-Uv $bootstrap
            if (-not $uv) { $uv = Get-StandaloneUv $UnslothHome }
            Write-Step "Creating the bootstrap environment with uv (Python $UnslothPythonDefault)"
            & $uv venv --quiet --python $UnslothPythonDefault $bootstrap
        }
        if ($LASTEXITCODE -ne 0) {
            Remove-Item -Recurse -Force -Path $bootstrap -ErrorAction SilentlyContinue
            Stop-Install 'could not create the bootstrap environment (output above)'
        }
    }
    Write-Step "Installing unsloth into the bootstrap environment from $Source"
    $bootUv = Join-Path $bootstrap 'Scripts\uv.exe'
    if (Test-Path $bootUv) {
        & $bootUv pip install --quiet --python $bootPython @indexArguments --reinstall-package unsloth-installer $Source
        if ($LASTEXITCODE -eq 0) { return $bootstrap }
    }
    $hasPip = $false
    try { & $bootPython -m pip --version *> $null; $hasPip = ($LASTEXITCODE -eq 0) } catch { $hasPip = $false }
    if ($hasPip) {
        # pip reads the user's pip configuration itself; UNSLOTH_* overrides go on top.
        & $bootPython -m pip install --quiet --disable-pip-version-check @indexArguments uv $Source
    } else {
        $uv = Find-Uv $bootstrap
        & $uv pip install --quiet --python $bootPython @indexArguments uv $Source
    }
    if ($LASTEXITCODE -ne 0) {
        Stop-Install "installing unsloth into $bootstrap failed (output above); your environment is unchanged"
    }
    return $bootstrap
}

# The same lock as `unsloth install` (a lock on the first byte of <home>\install.lock, as Python's
# msvcrt.locking takes it), held to the end: a concurrent run waits, then finds everything in place.
# The `unsloth install` started from here counts it as its own (UNSLOTH_LOCK_OWNER names us).
function Lock-UnslothHome {
    param([string]$UnslothHome)
    $path = Join-Path $UnslothHome 'install.lock'
    $stream = [System.IO.File]::Open($path, [System.IO.FileMode]::OpenOrCreate, [System.IO.FileAccess]::ReadWrite,
        [System.IO.FileShare]::ReadWrite)
    $waiting = $false
    while ($true) {
        try {
            $stream.Lock(0, 1)
            break
        } catch [System.IO.IOException] {
            if (-not $waiting) { Write-Step 'Another unsloth install is running; waiting for it to finish...' }
            $waiting = $true
            Start-Sleep -Milliseconds 200
        }
    }
    $env:UNSLOTH_LOCK_OWNER = [string]$PID
    return $stream
}

function Show-Usage {
    Write-Host @'
Install unsloth: a managed environment matched to this machine's GPU, and the `unsloth` command.

Usage: powershell -File install.ps1 [options] [-PassThrough @(options for `unsloth install`)]
       irm <release>/install.ps1 | iex          (options as UNSLOTH_* variables)

  -Yes                 do not ask (also UNSLOTH_YES=1)
  -DryRun              show what would happen and the plan; change nothing
  -Version V           install release V instead of the latest (UNSLOTH_VERSION)
  -Source PATH|URL     install this source tree or archive (UNSLOTH_SOURCE)
  -Home DIR            install home (UNSLOTH_HOME; default %LOCALAPPDATA%\unsloth)
  -BinDir DIR          where the `unsloth` launcher goes (UNSLOTH_BIN_DIR; default <home>\bin)
  -Python PY           use this Python (UNSLOTH_PYTHON)
  -IndexUrl URL        package index / mirror for everything but PyTorch (UNSLOTH_INDEX_URL)
  -ExtraIndexUrl URL   another index (UNSLOTH_EXTRA_INDEX_URL)
  -FindLinks DIR       a wheelhouse, for offline installs (UNSLOTH_FIND_LINKS)
  -TorchIndexUrl URL   take PyTorch from this index, e.g. a mirror (UNSLOTH_TORCH_INDEX_URL)
  -Without PART        leave out llama-cpp, export, bitsandbytes, fla or train (UNSLOTH_WITHOUT)
  -With PART           add vllm (Linux/WSL with an NVIDIA GPU only: refused here, use WSL) (UNSLOTH_WITH)
  -Pip                 install with pip instead of uv (UNSLOTH_INSTALLER=pip)
  -NoModifyPath        do not add the launcher's folder to the user PATH (UNSLOTH_NO_MODIFY_PATH=1)
  -Help                this help

The same options as install.sh (--index-url there is -IndexUrl here); see docs/install.md.
'@
}

function Install-Unsloth {
    param(
        [switch]$Yes,
        [switch]$DryRun,
        [string]$Version,
        [string]$Source,
        [Alias('Home')] [string]$InstallHome,  # $HOME is PowerShell's own, read-only
        [string]$BinDir,
        [string]$Python,
        [string]$IndexUrl,
        [string]$ExtraIndexUrl,
        [string]$FindLinks,
        [string]$TorchIndexUrl,
        [string]$Without,
        [string]$With,
        [switch]$Pip,
        [switch]$NoModifyPath,
        [switch]$Help,
        [string[]]$PassThrough = @()
    )
    if ($Help) {
        Show-Usage
        return
    }
    # Here, not at the top: `irm | iex` runs in the caller's session, whose preferences we leave alone.
    $ErrorActionPreference = 'Stop'
    # Parameters become the UNSLOTH_* variables `unsloth install` reads too: one set of names.
    if ($Version) { $env:UNSLOTH_VERSION = $Version }
    if ($Source) { $env:UNSLOTH_SOURCE = $Source }
    if ($InstallHome) { $env:UNSLOTH_HOME = $InstallHome }
    if ($BinDir) { $env:UNSLOTH_BIN_DIR = $BinDir }
    if ($Python) { $env:UNSLOTH_PYTHON = $Python }
    if ($IndexUrl) { $env:UNSLOTH_INDEX_URL = $IndexUrl }
    if ($ExtraIndexUrl) { $env:UNSLOTH_EXTRA_INDEX_URL = $ExtraIndexUrl }
    if ($FindLinks) { $env:UNSLOTH_FIND_LINKS = $FindLinks }
    if ($TorchIndexUrl) { $env:UNSLOTH_TORCH_INDEX_URL = $TorchIndexUrl }
    if ($Without) { $env:UNSLOTH_WITHOUT = $Without }
    if ($With) { $env:UNSLOTH_WITH = $With }
    if ($Pip) { $env:UNSLOTH_INSTALLER = 'pip' }
    if ($NoModifyPath) { $env:UNSLOTH_NO_MODIFY_PATH = '1' }

    $unslothHome = Get-UnslothHome
    $env:UNSLOTH_HOME = $unslothHome
    $pythonPath = Find-Python
    if (-not $pythonPath) { Write-Step "No Python $UnslothPythonMin to $UnslothPythonMax found: uv will provide Python $UnslothPythonDefault." }
    $packageSource = Get-PackageSource $PSCommandPath
    $env:UNSLOTH_SOURCE = $packageSource

    if ($DryRun) {
        Write-Step 'Dry run: nothing will change.'
        Write-Step "install home: $unslothHome"
        Write-Step "package source: $packageSource"
        if ($pythonPath) { Write-Step "Python: $pythonPath" } else { Write-Step "Python: $UnslothPythonDefault, provided by uv" }
        $bootUnsloth = Join-Path $unslothHome 'bootstrap\Scripts\unsloth.exe'
        if (Test-Path $bootUnsloth) {
            Write-Step 'The plan for this machine:'
            & $bootUnsloth install --dry-run @PassThrough
        } else {
            Write-Step 'The plan for this machine is shown by `unsloth install --dry-run` once the bootstrap exists.'
        }
        return
    }
    if (-not $Yes -and -not $env:UNSLOTH_YES -and [Environment]::UserInteractive -and -not [Console]::IsInputRedirected) {
        $answer = Read-Host "Install unsloth into $unslothHome? [Y/n]"
        if ($answer -and $answer -notmatch '^(y|yes)$') {
            Write-Step 'Nothing changed.'
            return
        }
    }
    New-Item -ItemType Directory -Force -Path $unslothHome | Out-Null
    $lock = Lock-UnslothHome $unslothHome
    try {
        Install-Locked -UnslothHome $unslothHome -Python $pythonPath -Source $packageSource -PassThrough $PassThrough
    } finally {
        $lock.Close()
    }
}

# The install proper, under the lock: the bootstrap environment, `unsloth install`, `unsloth doctor`.
function Install-Locked {
    param([string]$UnslothHome, [string]$Python, [string]$Source, [string[]]$PassThrough)
    $bootstrap = Install-Bootstrap -UnslothHome $unslothHome -Python $Python -Source $Source
    Write-Step 'Handing over to `unsloth install` for the hardware-aware rest'
    $currentFile = Join-Path $unslothHome 'current'
    $before = $null
    if (Test-Path $currentFile) { $before = (Get-Content -Raw $currentFile).Trim() }
    & (Join-Path $bootstrap 'Scripts\unsloth.exe') install --yes @PassThrough
    if ($LASTEXITCODE -ne 0) { Stop-Install 'unsloth install failed (see above); anything already installed is unchanged' }
    $binDir = $env:UNSLOTH_BIN_DIR
    if (-not $binDir) { $binDir = Join-Path $unslothHome 'bin' }
    $launcher = Join-Path $binDir 'unsloth.cmd'
    if ($before -and $before -eq (Get-Content -Raw $currentFile).Trim()) {
        Write-Step "Nothing changed. ``$launcher doctor`` checks the environment at any time."
        return
    }
    Write-Step 'Checking the result with `unsloth doctor`'
    & $launcher doctor
    if ($LASTEXITCODE -ne 0) { Stop-Install "unsloth doctor found a problem (see above); fix it, then run ``$launcher doctor`` again" }
    Write-Step "Done. Open a new terminal, then run: unsloth train --demo"
}

Install-Unsloth @args
